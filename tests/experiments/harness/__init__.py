"""Tests of experiments/harness."""
