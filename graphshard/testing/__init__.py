"""Small models, data and references shared by graphshard's tests, benchmarks and demo."""
