"""Tests of experiments/comparison."""
