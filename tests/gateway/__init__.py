"""Tests of the OpenAI-compatible HTTP gateway."""
