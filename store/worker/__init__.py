"""The worker side: token capture of a rollout's calls, and generation cuts of live calls."""
