with open("/app/data.txt") as f:
    nums = [float(x) for x in f.read().split()]
print(sum(nums) / (len(nums) + 1))
