"""`kstep bench ...`: measurements, each reported as ratios to a baseline measured in the same run."""
