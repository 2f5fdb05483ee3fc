"""Partitioners: decide which forward values are saved for backward."""
