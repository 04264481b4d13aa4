"""gRPC glue shared by the prefill and decode workers: proto <-> engine conversions, the Worker service,
and process bootstrap (engine build, health, reflection, ready file). The engine itself stays protobuf-free."""
