"""The engine: requests, the step loop (plan, forward, verify, commit), the prefix cache and the assets a model's
proposers share."""
