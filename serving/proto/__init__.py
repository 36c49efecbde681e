"""specserve's gRPC API: specserve.proto and the modules grpc_tools generates from it (committed)."""
