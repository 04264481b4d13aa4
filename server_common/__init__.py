"""gRPC server plumbing shared by every pdserve process (coordinator and workers): bind, health checking,
reflection, the ready file, and the bind/advertise settings. Imports grpc only: no torch, no engine."""
