"""Request lifecycle, scheduling policies, tree sizing, the state stores and the step loop: pure
bookkeeping over the workers' contract (`workers.contract`); the policies, sizing and the loop import
no torch."""
