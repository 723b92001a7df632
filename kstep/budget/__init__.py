"""Time budgets (`time_budget`): what a step costs on this device (costs.py), what a decoding runs at
worst (block.py for the block families, uniform.py for uniform diffusion) and the planner that picks
the most passes that fit (planner.py: one `plan` for every kind)."""
