"""The engine prompt of a token_in chat call: the parent's exact tokens, then the new turn.

A chat child's messages hold the parent's answer as text; vLLM renders them again, and the
re-rendered answer need not be the tokens the parent generated (a stop token the template
writes differently or drops, text that tokenizes another way).  Capture needs the exact
parent tokens in front (wire-contract 4.7), so the parent's turn is cut out of the rendered
prompt and the verified prefix is put in its place, as NeMo RL does: everything the template
renders after the parent's turn (the tool results or user turn, the generation prompt) is
kept as rendered.

Where the parent's turn ends in the child's rendering: the rendering of the conversation up
to and including the parent's answer (no generation prompt) holds ``n`` turn-end tokens (the
tokenizer's EOS), so the parent's turn ends at the ``n``-th turn-end token of the child's
rendering.  Counting, rather than measuring lengths, also holds when the template renders an
earlier answer shorter than the last one (templates that drop reasoning from earlier turns).
A template that writes no turn-end token at all (the parent's stop token is then missing from
the re-rendered text) renders the conversation up to the parent's answer as a prefix of the
child's prompt: what follows that prefix is the new turn.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from store.errors import CaptureDataError


def splice_verified_prefix(
    prefix: Sequence[int],
    rendered: Sequence[int],
    rendered_history: Sequence[int],
    end_token_ids: Collection[int],
) -> list[int]:
    """``prefix`` (the parent's exact tokens) followed by what ``rendered`` (the child's
    rendered prompt) holds from the end of the parent's turn on.

    ``rendered_history`` is the rendering of the child's messages up to and including the
    parent's answer, without a generation prompt; ``end_token_ids`` the tokens a turn ends
    with (the tokenizer's EOS).  The turn-end token itself is taken from the rendering, and a
    trailing turn-end token of ``prefix`` (the parent stopped on it) is not repeated.
    ``CaptureDataError`` when the parent's turn cannot be found in the child's rendering.
    """
    ends = set(end_token_ids)
    turns = sum(1 for token in rendered_history if token in ends)
    if turns == 0:
        if list(rendered[: len(rendered_history)]) == list(rendered_history):
            return [*prefix, *rendered[len(rendered_history) :]]
        raise CaptureDataError(
            "the chat template renders the conversation up to the parent's answer without an end-of-turn token "
            "and not as a prefix of the child's prompt: the parent's turn cannot be found in the rendered prompt"
        )
    seen = 0
    for position, token in enumerate(rendered):
        if token in ends:
            seen += 1
            if seen == turns:
                kept = list(prefix[:-1]) if prefix and prefix[-1] in ends else list(prefix)
                return [*kept, *rendered[position:]]
    raise CaptureDataError(
        f"the rendered prompt holds {seen} end-of-turn tokens, the conversation up to the parent's answer {turns}"
    )
