"""Worker plumbing shared by the three services: gRPC server life, settings, discovery and peers, internal auth, wire conversions, fault injection, timing log, background loops, worker metrics."""
