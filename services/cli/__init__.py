"""surgectl: the operator's gRPC client and the local stack launcher."""
