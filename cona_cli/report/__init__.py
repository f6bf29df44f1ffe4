"""`cona report`: read a run folder into typed records, compute time-to-perplexity and the chain
timeline, and plot them."""
