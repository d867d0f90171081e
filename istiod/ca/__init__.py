"""istiod's certificate authority: root of trust, signing, authentication, the CertificateService."""
