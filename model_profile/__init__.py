"""model_profile"""
