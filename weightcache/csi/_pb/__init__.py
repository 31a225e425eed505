"""Generated CSI v1 stubs (csi_pb2, csi_pb2_grpc). Produced by scripts/gen_csi.py from csi/csi.proto; never edit."""
