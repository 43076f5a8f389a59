"""The decoding core: draft trees, verification, sampling, logits processing, structured output, detokenization
and chat templates. It imports nothing else of specdecode."""
