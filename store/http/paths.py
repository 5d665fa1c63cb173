"""The control routes' paths (shared by the routes and the client; imports nothing)."""

CUT_PATH = "/ng-control/v1/generation-cut"
LEDGER_PREFIX = "/training-token-capture/control"
