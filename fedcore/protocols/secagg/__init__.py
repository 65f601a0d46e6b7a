"""SecAgg+ (Bell et al. 2020, "Secure Single-Server Aggregation with (Poly)Logarithmic
Overhead"): the server learns the sum of the clients' quantized updates and nothing else, even
when clients drop out mid-round. Each client masks its input with a self mask and with pairwise
masks shared with its neighbours on a sparse random graph, and Shamir-shares the seeds of both
among those neighbours, so the server can remove the self masks of the clients that reported
and the pairwise masks of the ones that dropped. ``maths`` holds the field, Shamir sharing, the
sharing graph, the choice of degree and threshold, fixed-point quantization and the masks;
``keys`` holds the per-round X25519 keys, the AES-GCM sealing of shares and the signatures of
a client's round keys with its TLS identity key.
"""
