"""FX passes around the partition (RNG replay, reports); none yet."""
