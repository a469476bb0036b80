"""telemetry"""
