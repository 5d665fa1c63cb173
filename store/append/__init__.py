"""The append path: write transactions with group commit, and the rules a staged event passes."""
