"""Generated gRPC stubs for the pdserve.v1 protos (created at install time from proto/; not committed)."""
