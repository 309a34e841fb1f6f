"""What the benchmark scripts share: the servers they start, what they read from them and the host, and how they report it."""
