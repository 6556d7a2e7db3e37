"""Tests of the lab code under benchmarks/ (not part of the installed packages)."""
