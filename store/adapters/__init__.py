"""Engine adapters (``CaptureAdapter``): how a serving engine's requests and responses carry tokens."""
