"""Building blocks shared by every model family: norm, rotary, attention, MLP."""
