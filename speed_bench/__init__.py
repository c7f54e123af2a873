"""speed_bench"""
