"""Cost and policy: what a forward of n tokens costs here, how many threads it runs on, and how many tokens to
guess (the policy that keeps speculation from ever being slower than plain decoding)."""
