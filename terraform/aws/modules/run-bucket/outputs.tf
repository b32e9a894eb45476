output "bucket_name" {
  description = "Name of the run bucket."
  value       = aws_s3_bucket.run.id
}

output "bucket_arn" {
  description = "ARN of the run bucket."
  value       = aws_s3_bucket.run.arn
}

output "bucket_region" {
  description = "Region the bucket lives in (its home region)."
  value       = aws_s3_bucket.run.region
}

output "store_url" {
  description = "The --store URL of the run (s3://BUCKET/PREFIX) for ddiloco-geo learner, syncer and selfcheck."
  value       = "s3://${aws_s3_bucket.run.id}/${var.run_prefix}"
}

output "bucket_policy_json" {
  description = "The bucket policy document (TLS-only, and deny-others writes when writer_principal_arns is set)."
  value       = data.aws_iam_policy_document.bucket.json
}
