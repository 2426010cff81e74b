"""Models and projections: the RL-step simulator, projected SD speedup, memory plans from abstract shapes."""
