output "bucket_name" {
  description = "Name of the run bucket."
  value       = module.bucket.bucket_name
}

output "store_url" {
  description = "The --store URL of the run (s3://BUCKET/PREFIX)."
  value       = module.bucket.store_url
}

output "role_prefixes" {
  description = "Role key -> read and write prefixes the policies grant, relative to the run."
  value       = module.iam.role_prefixes
}

output "policy_json" {
  description = "Role key -> S3 policy document attached to that role."
  value       = module.iam.policy_json
}

output "bucket_policy_json" {
  description = "The bucket policy (TLS-only, deny writes by anyone but the roles)."
  value       = module.bucket.bucket_policy_json
}
