"""cartridges"""
