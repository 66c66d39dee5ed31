"""The FUSE mount: a binding-free filesystem (volumefs) behind one binding module."""
