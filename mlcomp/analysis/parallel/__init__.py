"""Models of parallel execution: pipeline schedules and their simulator, schedule orders, placement cost."""
