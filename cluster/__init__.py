"""The pool: gRPC router, Ray card registry, Prometheus metrics."""
