# Optional GCP region for the multi-region run: spot learners on GCE that write to the S3 bucket
# of examples/multi-region. Its own root, so the AWS root needs no google provider. The learners'
# service account exchanges its Google identity token for the fleet role (web identity federation).

provider "google" {
  project = var.project
  region  = var.region
}

resource "google_service_account" "learner" {
  project      = var.project
  account_id   = substr("dd-${var.fleet}", 0, 30)
  display_name = "ddiloco-geo learners ${var.fleet} (AWS role ${var.aws_role_arn})"
}

module "learners" {
  source = "../../../gcp/modules/learner-mig"

  project               = var.project
  region                = var.region
  fleet                 = var.fleet
  service_account_email = google_service_account.learner.email
  store_url             = var.store_url
  bucket_region         = var.bucket_region
  run_id                = var.run_id
  web_identity_role_arn = var.aws_role_arn
  target_size           = var.target_size
  package_spec          = var.package_spec
  settings              = var.settings
}
