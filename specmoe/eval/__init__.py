"""Model-quality evaluation (held-out perplexity), used to compare expert storage formats."""
