"""Generated gRPC stubs (do not edit; `make proto` regenerates them from proto/)."""
