"""The comparison of algorithms: the plan of runs, running them, their statistics and the report."""
