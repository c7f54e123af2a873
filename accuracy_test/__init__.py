"""accuracy_test"""
