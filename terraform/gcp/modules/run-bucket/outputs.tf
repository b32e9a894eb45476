output "bucket_name" {
  description = "Name of the run bucket."
  value       = google_storage_bucket.run.name
}

output "store_url" {
  description = "The --store URL of the run (gs://BUCKET/PREFIX)."
  value       = "gs://${google_storage_bucket.run.name}/${var.run_prefix}"
}
