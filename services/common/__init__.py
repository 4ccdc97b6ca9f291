"""Plumbing shared by every service: gRPC servers, logging, paths. No seed module lives here."""
