"""Tests of the example clients in examples/."""
