"""Structured output: constraints compiled to grammars (llguidance), one matcher per request,
token bitmasks for plain decoding, verification and drafting (docs/serving.md, "Structured
output and tools").

Below core/ and sample/ (it imports only the base modules): the request holds its matcher,
the verifier applies its masks, proposers mask their own drafts, and the engine orchestrates.
"""
