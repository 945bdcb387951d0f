"""The speculative engine: proposers, verification, and the on-device round loop."""
