"""Tests that compile whole models end to end."""
