"""Launching helpers of the server process (torch-free)."""
