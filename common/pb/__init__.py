"""Generated protobuf code; regenerate with python -m common.protogen."""
