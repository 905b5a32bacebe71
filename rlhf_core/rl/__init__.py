"""The RL stage: the single controller, its roles, engines, experience and checkpoints."""
