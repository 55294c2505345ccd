"""Request lifecycle, scheduling policies, the step loop and the simulator."""
