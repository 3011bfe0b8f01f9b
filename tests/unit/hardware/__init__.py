"""Unit tests of mlcomp.hardware."""
